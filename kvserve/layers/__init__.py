"""Model building blocks: paged attention, rotary embedding, RMSNorm."""
