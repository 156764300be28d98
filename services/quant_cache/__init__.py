"""quant-cache: stores rollout guidance and routing records in Redis (docs/design.md, "The system")."""
