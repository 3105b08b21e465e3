"""placeholder"""


def add_parser(sub) -> None:
    p = sub.add_parser("k8s", help="Kubernetes manifests")
    p.add_argument("action", choices=["render"])
