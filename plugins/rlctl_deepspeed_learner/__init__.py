"""DeepSpeed learner plugin: ZeRO-1/2/3 over a group of processes rlctl starts itself (optional extra ``deepspeed``)."""
