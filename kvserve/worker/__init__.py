"""The model runner: builds batched inputs from a SchedulerOutput, runs the model, samples."""
