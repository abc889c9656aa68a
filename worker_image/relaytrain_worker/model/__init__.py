"""The model slice a stage trains: shard reading, the families' forward steps, building
and loading the slice, the training methods (LoRA, QLoRA, full), the optimizer and schedule,
and the one-off preparation of the demo model. Nothing here touches a store or a link."""
