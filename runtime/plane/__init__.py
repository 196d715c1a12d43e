"""The rank's control plane: context and generations, the heartbeat thread, channels, auth, protocol."""
