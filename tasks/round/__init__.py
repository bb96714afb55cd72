"""What every stage of a round shares: its context, the typed records stages hand each other, the round's
MLflow run and health report, and the crash points resume tests use."""
