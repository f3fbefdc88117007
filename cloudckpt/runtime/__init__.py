"""The training process: rank coordination, saves pending at exit, interrupts, application state."""
