"""How good the pretrained backbone is on its own task: blood.toml's LeNet-5 on the 20 % of the BloodMNIST
train split that its site holds out as test (the pretraining pooled the site's 60 % training part only).
    python docs/results/partial_labels/proxy/pretrain_check.py runs/partial-labels-proxy/blood-lenet5-bn.safetensors
"""
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from fedmqtt.data.registry import load_site_data
from fedmqtt.data.spec import DataSpec
from fedmqtt.training.models import build_model

here = Path(__file__).resolve().parent
blood = DataSpec(format="medmnist", path=here / "../../../../../shared/datasets/medmnist/bloodmnist.npz",
                 options={"splits": ["train"], "channels": 1})
data = load_site_data(blood)
model = build_model("lenet5", {"n_classes": 8, "in_channels": 1, "norm": "bn"})
model.load_state_dict(load_file(sys.argv[1]))
model.eval()
with torch.no_grad():
    pred = model(torch.as_tensor(data.x_test, dtype=torch.float32)).argmax(dim=1).numpy()
print(f"BloodMNIST held-out accuracy {np.mean(pred == data.y_test):.3f} (n = {len(pred)}), "
      f"majority class {np.bincount(data.y_test).max() / len(data.y_test):.3f}")
