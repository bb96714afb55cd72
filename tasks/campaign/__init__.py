"""What starts rounds: the base policy (round 0), input checks before a campaign writes anything, a start point
resolved from the registry, and replay of stored trajectories."""
