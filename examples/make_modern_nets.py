"""Write examples/nets/{resnet18,resnet18_cifar,resnet50,mobilenet_v2,resnet20_cifar,efficientnet_b0}.json from the models as
torchvision defines them (tests/test_modern_nets.py writes them out), through from_torch: what
`pcldnn-gen import` or a training script would make of the real ones. Needs torch.

    python examples/make_modern_nets.py [--out DIR]    # default: examples/nets

ResNet-20 is He et al.'s CIFAR net (3 stages of 3 basic blocks, 16-32-64 channels) with 1x1
projection shortcuts where a stage changes size (their option B: the parameter-free option A
pads channels with zeros, which no layer here does).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from test_modern_nets import BasicBlock, Bottleneck, EfficientNet, MobileNetV2, ResNet, nn  # noqa: E402

import pcldnn_gen  # noqa: E402


class CifarResNet(ResNet):
    """ResNet-20 and its family: three stages at 16, 32 and 64 channels on 32x32 images."""

    def __init__(self, blocks: int, num_classes: int = 10):
        nn.Module.__init__(self)
        self.inplanes = 16
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
        self.layer1 = self._make_layer(BasicBlock, 16, blocks)
        self.layer2 = self._make_layer(BasicBlock, 32, blocks, 2)
        self.layer3 = self._make_layer(BasicBlock, 64, blocks, 2)
        self.layer4 = nn.Identity()
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(64, num_classes)


V2_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
               (6, 320, 1, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", type=Path, default=HERE / "nets", help="folder to write into (default: %(default)s)")
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    nets = {
        "resnet18": (ResNet(BasicBlock, [2, 2, 2, 2], num_classes=1000), (3, 224, 224)),
        # ResNet-18 in its CIFAR layout: the 3x3 stride-1 stem without the max pooling, 10 classes
        "resnet18_cifar": (ResNet(BasicBlock, [2, 2, 2, 2], num_classes=10, cifar=True), (3, 32, 32)),
        "resnet50": (ResNet(Bottleneck, [3, 4, 6, 3], num_classes=1000), (3, 224, 224)),
        "mobilenet_v2": (MobileNetV2(num_classes=1000, width=1.0, settings=V2_SETTINGS, last=1280), (3, 224, 224)),
        "resnet20_cifar": (CifarResNet(3), (3, 32, 32)),
        # torchvision's EfficientNet-B0 (stochastic depth, a random row drop, left out)
        "efficientnet_b0": (EfficientNet(num_classes=1000), (3, 224, 224)),
    }
    for name, (model, shape) in nets.items():
        net, _ = pcldnn_gen.from_torch(model, shape, name=name)
        path = out / f"{name}.json"
        head = {k: v for k, v in net.items() if k != "layers"}
        lines = ",\n".join("    " + json.dumps(layer) for layer in net["layers"])
        path.write_text(json.dumps(head)[:-1] + ',\n  "layers": [\n' + lines + "\n  ]\n}\n")
        print(f"{path}: {len(net['layers'])} layers")


if __name__ == "__main__":
    main()
