"""Elastic training: a supervisor that launches one process per host, watches them over its own heartbeat
channel, isolates a failed host, continues on the survivors from the latest checkpoint and re-admits a repaired
host. See docs/elastic.md; the trainer's side is `reve_jax.elastic.worker.init_from_env`."""
