"""weight-sync: versioned policy weights from the trainer to the rollout replicas (DESIGN.md section 4)."""
