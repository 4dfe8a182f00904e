"""Zero-downtime upgrade: handing every connection and lock to a successor (docs/upgrade.md)."""
