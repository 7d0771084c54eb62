"""The model zoo: torchvision and timm models through both engines (slow; needs torchvision/timm)."""
