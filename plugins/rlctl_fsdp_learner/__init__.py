"""FSDP2 learner plugin: a group of processes sharding one policy with torch.distributed.fsdp.fully_shard."""
