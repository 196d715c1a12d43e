"""The control plane's server side: the store, operator commands, failure injection."""
