"""The rollout stage: prompts fed lazily to the engine, samples verified as they finish, the ready pool that
stops the round once its trainable batch is full, carry-over, overlap mode and speculative rollout."""
