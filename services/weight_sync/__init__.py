"""weight-sync: versioned policy weights from the trainer to the rollout replicas (docs/design.md, "The system")."""
