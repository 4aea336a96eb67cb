# Policy: CPU binding and memory policy (numa_bind, set_mempolicy, sched_setaffinity, ...).
