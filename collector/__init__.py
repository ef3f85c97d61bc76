"""tp-query."""
