"""Tools around training: the throughput benchmark (bench/) and planning past one machine (plan/)."""
