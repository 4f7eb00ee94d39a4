"""The performance model of an engine iteration (roofline, interference, tensor-parallel all-reduce), the
training step model, and the tables measured on GPUs that calibrate them."""
