"""Benchmarks: throughput and MFU of the train step (throughput.py), with the reference PyTorch DiT as a peer."""
