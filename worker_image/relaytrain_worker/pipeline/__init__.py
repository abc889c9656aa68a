"""One pipeline stage: its neighbour links, the 1F1B step, held-out evaluation, and the
stage's life (load, link, resume, train, checkpoint, progress, output). It knows of other
pipelines only through `replication.Replication` (alone: `replication.Alone`)."""
