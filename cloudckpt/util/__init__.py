"""Small helpers every layer may use: checksums, text, logging set-up."""
