"""The publish stage: a committed checkpoint registered with its lineage, and the description a person auditing a
model version reads."""
