"""The model zoo: one module per architecture family, every output layer named `head`."""

from __future__ import annotations

from fedmqtt.training.zoo.common import NORMS, gn_groups
from fedmqtt.training.zoo.lenet import LeNet5
from fedmqtt.training.zoo.mlp import MLP
from fedmqtt.training.zoo.recurrent import GRUNet
from fedmqtt.training.zoo.resnet1d import ResNet1dSE
from fedmqtt.training.zoo.transformer import TransformerNet
from fedmqtt.training.zoo.vision import alexnet, densenet121, efficientnet_b0

__all__ = [
    "GRUNet", "LeNet5", "MLP", "NORMS", "ResNet1dSE", "TransformerNet",
    "alexnet", "densenet121", "efficientnet_b0", "gn_groups",
]
