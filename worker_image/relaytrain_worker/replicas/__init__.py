"""Several pipelines of one job (the multi-pipeline protocol): the exact arithmetic of a
shared step, the star exchange over replica links, membership (who trains a step, who
writes, rejoining with a live peer's state) and periodic synchronisation. Above the single
pipeline (`pipeline/`), which it drives through `pipeline.replication.Replication`."""
