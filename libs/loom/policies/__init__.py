"""Pure scheduling and placement policies: state and input in, decision out, no I/O."""
