"""`python -m fedmqtt` is the `fedmqtt` command."""

from fedmqtt.cli import main

main()
