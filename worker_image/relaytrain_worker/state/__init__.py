"""What a stage reads and writes through the job's store: the store itself, checkpoints,
the loss history, progress.json, the output, the model's files, the training data, and the
stage's metrics."""
