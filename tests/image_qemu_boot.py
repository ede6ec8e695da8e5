#!/usr/bin/env python3
"""Boot a `build-image.sh --target qemu` image in qemu-system-aarch64 -M virt
and check it over SSH (forwarded to 127.0.0.1 only; the guest's user-mode
network is restricted to the host):

  * appliance.service is active, i.e. it sent READY=1 (Type=notify);
  * `appliance doctor` runs and prints its table;
  * first boot did its job: machine-id generated, SSH host keys generated,
    data partition grown to the (enlarged) disk, /etc/appliance mounted;
  * no account has a usable password unless one was given at build time;
  * the owner edits the config with sudoedit and reloads the service with no
    password (the sudo rule for key-only images), first-boot provisioning
    left its once-only marker, and the nftables firewall is active.

`--check-tools` only checks that qemu-system-aarch64, qemu-img, ssh and
sfdisk are installed (make test-image runs it before the build).

Then powers the guest off (ACPI power button through QMP).

Usage (what `make test-image` runs):
  python3 tests/image_qemu_boot.py out/appliance-<v>-qemu.img --key out/test-image-key
Exit status 0 when every check passed. Console log: <image>.console.log
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def disk_signature(img: Path) -> str:
    table = json.loads(subprocess.check_output(["sfdisk", "--json", str(img)]))["partitiontable"]
    return table["id"].lower().removeprefix("0x")


def qmp(sock_path: str, command: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(sock_path)
        f = s.makefile("rw")
        f.readline()  # greeting
        for cmd in ("qmp_capabilities", command):
            f.write(json.dumps({"execute": cmd}) + "\n")
            f.flush()
            f.readline()


class Guest:
    def __init__(self, port: int, key: Path, user: str):
        self.port, self.key, self.user = port, key, user

    def ssh(self, cmd: str, timeout: float = 60, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", "-q", "-i", str(self.key), "-p", str(self.port),
             "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
             "-o", "ConnectTimeout=5", "-o", "BatchMode=yes",
             f"{self.user}@127.0.0.1", cmd],
            capture_output=True, text=True, timeout=timeout, input=stdin,
        )


# [Service] settings of appliance.service that describe the sandbox (not how
# the process is started, stopped or supervised).
NOT_SANDBOX = ("Type", "NotifyAccess", "ExecStartPre", "ExecStart", "ExecReload", "Restart", "RestartSec",
               "RestartPreventExitStatus", "TimeoutStartSec", "TimeoutStopSec", "WatchdogSec")


def sandbox_properties(guest: "Guest") -> list[str]:
    text = guest.ssh("cat /etc/systemd/system/appliance.service").stdout
    props, section = [], ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
            continue
        if section != "[Service]" or not line or line.startswith("#") or "=" not in line:
            continue
        key = line.split("=", 1)[0]
        if key not in NOT_SANDBOX:
            props.append("-p " + shlex.quote(line))
    return props


# Run as the admin over SSH. The last two lines: the service state after the
# reload, and what sudo says to a command outside the rule.
OWNER_SCRIPT = r"""
exec 2>&1
printf '#!/bin/sh\necho "# edited by the owner" >>"$1"\n' >~/owner-edit && chmod +x ~/owner-edit
SUDO_EDITOR=$HOME/owner-edit sudoedit -n /etc/appliance/config.yaml; echo "edit=$? $(tail -n1 /etc/appliance/config.yaml)"
sudo -n systemctl reload appliance; echo "reload=$?"
sleep 5
echo "state=$(systemctl show -p ActiveState --value appliance.service)"
echo "other=$(sudo -n cat /etc/shadow 2>&1 | head -n1)"
echo "marker=$(cat /var/lib/appliance-firstboot/provisioned 2>&1)"
echo "nft=$(systemctl is-active nftables)"
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("image", type=Path, nargs="?")
    ap.add_argument("--check-tools", action="store_true", help="only check the tools this test needs")
    ap.add_argument("--key", type=Path, help="SSH private key whose .pub was given to --ssh-key")
    ap.add_argument("--user", default="admin")
    ap.add_argument("--kernel", type=Path)
    ap.add_argument("--initrd", type=Path)
    ap.add_argument("--memory", default="4096")
    ap.add_argument("--smp", default="2")
    ap.add_argument("--grow", default="1G", help="enlarge the disk by this much to exercise first-boot growth")
    ap.add_argument("--boot-timeout", type=float, default=900, help="seconds until SSH must answer")
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds until appliance.service is active")
    ap.add_argument("--sudo-password", default=os.environ.get("APPLIANCE_PASSWORD"),
                    help="the admin password given to build-image.sh --password (default: $APPLIANCE_PASSWORD); "
                         "enables the in-sandbox doctor check")
    args = ap.parse_args()
    tools = {"qemu-system-aarch64": "qemu-system-arm", "qemu-img": "qemu-utils", "ssh": "openssh-client",
             "sfdisk": "fdisk"}
    missing = [f"{t} ({p})" for t, p in tools.items() if not shutil.which(t)]
    if missing:
        print(f"image_qemu_boot.py: missing tools: {', '.join(missing)} — apt-get install "
              f"{' '.join(sorted({tools[m.split()[0]] for m in missing}))}", file=sys.stderr)
        return 2
    if args.check_tools:
        return 0
    if args.image is None or args.key is None:
        ap.error("the image to boot and --key are required")

    img = args.image.resolve()
    stem = str(img).removesuffix(".img")
    kernel = args.kernel or Path(stem + ".vmlinuz")
    initrd = args.initrd or Path(stem + ".initrd")
    for p in (img, kernel, initrd, args.key):
        if not p.exists():
            print(f"missing: {p}", file=sys.stderr)
            return 2

    sig = disk_signature(img)
    tmp = Path(tempfile.mkdtemp(prefix="appliance-qemu-"))
    disk = tmp / "disk.qcow2"
    # Copy-on-write overlay: the built image stays untouched; a larger virtual
    # size lets first boot grow the data partition.
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(img), str(disk)], check=True)
    if args.grow:
        subprocess.run(["qemu-img", "resize", "-q", str(disk), f"+{args.grow}"], check=True)
    port = free_port()
    qmp_sock = str(tmp / "qmp.sock")
    console = Path(stem + ".console.log")
    cmdline = f"root=PARTUUID={sig}-02 rootfstype=ext4 rootwait fsck.repair=yes console=ttyAMA0"
    cmd = [
        "qemu-system-aarch64", "-M", "virt", "-cpu", "cortex-a76", "-smp", args.smp, "-m", args.memory,
        "-nographic", "-no-reboot",
        "-kernel", str(kernel), "-initrd", str(initrd), "-append", cmdline,
        "-drive", f"if=none,id=hd0,file={disk},format=qcow2",
        "-device", "virtio-blk-pci,drive=hd0",
        "-netdev", f"user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:{port}-:22",
        "-device", "virtio-net-pci,netdev=n0,romfile=",  # no iPXE option ROM needed
        "-device", "virtio-rng-pci",
        # A sound card so ALSA has a device (no host audio: the 'none' backend).
        "-audiodev", "none,id=snd0", "-device", "intel-hda", "-device", "hda-duplex,audiodev=snd0",
        "-qmp", f"unix:{qmp_sock},server=on,wait=off",
        "-serial", f"file:{console}", "-monitor", "none",
    ]
    print("+", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    vm = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    guest = Guest(port, args.key, args.user)
    failures: list[str] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True)
        if not ok:
            failures.append(name)

    try:
        while True:
            if vm.poll() is not None:
                check("guest boots", False, f"qemu exited with {vm.returncode}")
                return 1
            try:
                if guest.ssh("true", timeout=20).returncode == 0:
                    break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - t0 > args.boot_timeout:
                check("SSH answers", False, f"no answer in {args.boot_timeout:.0f} s (see {console})")
                return 1
            time.sleep(5)
        check("SSH answers (key login)", True, f"after {time.monotonic() - t0:.0f} s")

        deadline = time.monotonic() + args.ready_timeout
        props: dict[str, str] = {}
        while time.monotonic() < deadline:
            r = guest.ssh("systemctl show -p ActiveState,SubState,Result,NRestarts,StatusText appliance.service")
            props = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
            # Type=notify: "active/running" is reached only after READY=1.
            if props.get("ActiveState") in ("active", "failed"):
                break
            time.sleep(5)
        ready = props.get("ActiveState") == "active" and props.get("SubState") == "running"
        check("appliance.service active (READY=1 received)", ready,
              f"{props} after {time.monotonic() - t0:.0f} s")
        if not ready:
            r = guest.ssh("journalctl -b -u appliance.service --no-pager -n 40 2>&1 || true")
            print(r.stdout, file=sys.stderr)

        r = guest.ssh("/usr/local/bin/appliance doctor; echo \"exit=$?\"", timeout=300)
        out = r.stdout + r.stderr
        ran = "exit=" in out and "Traceback" not in out
        print(out, flush=True)
        check("appliance doctor runs", ran, out.strip().splitlines()[-1] if out.strip() else "no output")

        if args.sudo_password:
            # `appliance doctor` inside the service's own sandbox: every
            # [Service] hardening setting of the installed unit, as a
            # transient unit. Proves the sandbox still lets the app reach the
            # sound card (ALSA), the config and its state directory.
            props = sandbox_properties(guest)
            cmd = ("sudo -S -p '' systemd-run --quiet --wait --pipe --collect " + " ".join(props) +
                   " /opt/appliance/venv/bin/appliance doctor --config /etc/appliance/config.yaml; echo \"exit=$?\"")
            r = guest.ssh(cmd, timeout=300, stdin=args.sudo_password + "\n")
            out = r.stdout + r.stderr
            print(out, flush=True)
            audio_ok = any(line.startswith("audio input") and "PASS" in line for line in out.splitlines())
            check("doctor inside the service sandbox reaches the sound card", audio_ok and "exit=" in out,
                  next((ln for ln in out.splitlines() if ln.startswith("audio input")), "no audio line"))

        # The owner of the image edits the config and applies it without a
        # password (sudo -n fails rather than prompt): the appliance-owner rule.
        before = guest.ssh("systemctl show -p ActiveState --value appliance.service").stdout.strip()
        r = guest.ssh("bash -s", stdin=OWNER_SCRIPT)
        out = r.stdout + r.stderr
        print(out, flush=True)
        kv = dict(line.split("=", 1) for line in out.splitlines() if "=" in line and line.split("=", 1)[0].isalpha())
        check("owner edits the config with sudoedit, no password",
              kv.get("edit", "").startswith("0 # edited by the owner"), kv.get("edit", "no edit line"))
        check("owner reloads the service, no password; it keeps running",
              kv.get("reload") == "0" and kv.get("state") == before, f"reload={kv.get('reload')}, {before} -> {kv.get('state')}")
        check("other root commands still need the password", "password is required" in kv.get("other", ""),
              kv.get("other", ""))
        check("first-boot provisioning marker left", bool(re.match(r"\d{4}-\d\d-\d\dT", kv.get("marker", ""))),
              kv.get("marker", ""))
        check("firewall (nftables) active", kv.get("nft") == "active", kv.get("nft", ""))

        r = guest.ssh("cat /etc/machine-id")
        check("machine-id generated on first boot", len(r.stdout.strip()) == 32 and r.stdout.strip() != "uninitialized",
              r.stdout.strip())
        r = guest.ssh("ls /etc/ssh/ssh_host_ed25519_key.pub")
        check("SSH host keys generated on first boot", r.returncode == 0)
        r = guest.ssh("findmnt -n -o SOURCE,FSTYPE,OPTIONS /var/lib/appliance; findmnt -n -o TARGET /etc/appliance; "
                      "df -B1M --output=size /var/lib/appliance | tail -n1; test -r /etc/appliance/config.yaml && echo cfg-ok")
        check("data partition mounted with data=journal, /etc/appliance bound", "data=journal" in r.stdout
              and "/etc/appliance" in r.stdout and "cfg-ok" in r.stdout, " ".join(r.stdout.split()))
        r = guest.ssh("journalctl -b -u appliance-firstboot --no-pager -o cat 2>/dev/null | grep -i growing || "
                      "cat /var/lib/appliance-firstboot/grown 2>/dev/null; test -e /var/lib/appliance-firstboot/grown && echo grown")
        check("data partition grown on first boot", "grown" in r.stdout, " ".join(r.stdout.split())[:200])
        r = guest.ssh("systemctl is-system-running || true")
        print(f"system state: {r.stdout.strip()}", flush=True)
        r = guest.ssh("systemctl --failed --no-legend --plain || true")
        if r.stdout.strip():
            print("failed units:\n" + r.stdout, flush=True)
    finally:
        try:
            qmp(qmp_sock, "system_powerdown")
            vm.wait(timeout=120)
            print(f"guest powered off ({vm.returncode})", flush=True)
        except Exception as exc:  # noqa: BLE001 - any failure here: stop qemu hard
            print(f"power-off did not complete ({exc!r}); stopping qemu", flush=True)
            vm.terminate()
            try:
                vm.wait(timeout=20)
            except subprocess.TimeoutExpired:
                vm.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{len(failures)} failed" if failures else "all image boot checks passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
