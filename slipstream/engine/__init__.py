"""The engine: sequences, block manager, scheduler, model runner, and the step loop."""
