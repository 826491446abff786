"""What the stages share: schema, artifacts, run directory, models, losses, task."""
