"""Rollout engines: how one is built and placed, and the live engines a campaign keeps serving across rounds."""
