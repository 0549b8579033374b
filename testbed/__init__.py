"""Where multi-rank jobs run, for the tests, the benchmarks and the demo (never imported by training
code): launching a job with a hard timeout (launch.py), several jobs in one launch (batch.py), network
namespaces with a rate-limited loopback and their byte counters (wire.py), and emulated hosts joined
by a rate-limited link (hosts.py, with the lock that keeps two users apart: hosts_lock.py)."""
