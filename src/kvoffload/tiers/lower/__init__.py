"""What every tier under host shares: the block format and codec (header, length, CRC, seal), the circuit breaker,
the I/O threads, the job waits and the lower-tier handler skeleton. Both halves may import these; none imports a
tier."""
