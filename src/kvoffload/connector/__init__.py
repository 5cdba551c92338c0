"""What an engine calls each step: the scheduler half and the worker half."""
