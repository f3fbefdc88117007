"""Moving checkpoints: copies between stores, uploads, downloads, whole trees."""
