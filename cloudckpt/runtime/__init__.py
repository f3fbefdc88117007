"""The training process: rank coordination, saves pending at exit, application state."""
