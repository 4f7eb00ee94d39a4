"""The NATS runtime every service stands on: the bus (connections, streams, buckets, failover), the service
runtime (health, metrics, drain), leases, the worker registry, work queues, the generation client, the result
stream, the private nats-server, and the supervisor and lifecycle of the processes `loom up` starts."""
