"""quant-cache: stores rollout guidance and routing records in Redis (see DESIGN.md section 4)."""
