"""Mosquitto broker for a federation: config, ACL, passwords, process control."""
