"""The filter stage (advantages, drop rules, the trajectory version's commit) and re-filtering / re-verification
of committed versions."""
