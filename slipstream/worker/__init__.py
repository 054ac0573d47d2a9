"""The model side of a step: SchedulerOutput in, an input batch of flat tensors, one forward, samples out."""
