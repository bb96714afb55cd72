"""The train stage: the policy update over a round's kept samples, in this process or on a sharded worker group."""
