"""A learner: the training loop and everything it decides on its own, with no coordinator.

- :mod:`.loop`: the learner's loop (inner steps, fragment rounds, checkpoints, leaving).
- :mod:`.startup`: start-up (checkpoint directory, DHT, lineage, data, model, averager).
- :mod:`.resume`: resuming from a checkpoint (whether it fits, loading it, what was in flight).
- :mod:`.state`: what a learner holds, shared by its parts (global state per fragment, counters).
- :mod:`.schedule`: which fragment rounds are due and starting them (the round schedule).
- :mod:`.phase`: keeping in phase with the swarm's rounds on the steps schedule.
- :mod:`.round`: one outer round of one fragment, as an object with explicit stages.
- :mod:`.catch_up`: deciding that the swarm is ahead and downloading the newer state.
- :mod:`.swarm_end`: what the progress records say of the run's end (who finished, who left without us).
- :mod:`.parting`: leaving (stop signals, parting rounds that hand unmerged steps on).
- :mod:`.progress`: publishing this learner's progress record, reading the swarm's.
- :mod:`.healing`: a learner whose training diverges takes the global state back and trains on.
- :mod:`.head_start`: work done on a thread while the DHT joins the swarm.
- :mod:`.lean`: keeping the learner's processes small (malloc arenas; p2pd's GOGC is in net/dht.py).
- :mod:`.metrics`: Prometheus metrics and the resource fields of a progress record.
- :mod:`.audit`: the audit log, one hash-chained, signed JSON line per event.
- :mod:`.unit`: a learner unit of several torchrun workers (rank 0 leads, the others follow).
"""
