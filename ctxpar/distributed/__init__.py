"""The rank grid and how DeepSpeed sees it: process groups, the mpu, ZeRO over dp x cp,
the pipeline topology, the gradient norm and deepspeed.comm's start-up."""
