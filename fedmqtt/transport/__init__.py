"""MQTT transport: topic builders, a thin paho-mqtt client, typed channels."""
