"""Running a training job: `CheckpointManager` (`_manager`) and its tiers (`_tiers`), a
run's steps (`_steps`), retention (`_retention`) and preemption notices
(`_preemption`); the local tier is the `_local` package beside this one. Imported by
module path; this face holds nothing."""
