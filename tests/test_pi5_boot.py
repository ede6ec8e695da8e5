"""The Pi 5 boot-partition checker (tools/check-pi5-boot) on fake inputs.

A Pi 5 cannot be booted here (QEMU has no BCM2712 machine), so the checker
is what stands between a build and a card that does not start. Each check
is shown passing on a boot partition laid out like each kernel kind's, and
failing on a copy with exactly that one thing broken. The inputs are made at
test time by tests/pi5_fakes.py (real dtc device trees, a real cpio
initramfs, an arm64 Image header): the kernel packages themselves cannot be
installed in the fast tests. The build-image.sh runs that reach the checker
and pi5_boot_files are in tests/test_image.py; the real image is
`make test-image-pi5`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pi5_fakes as fakes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CHECKER = REPO / "tools" / "check-pi5-boot"
SIG = "a1b2c3d4"

pytestmark = pytest.mark.skipif(
    not (shutil.which("dtc") and shutil.which("lsinitramfs")),
    reason="needs dtc (device-tree-compiler) and lsinitramfs (initramfs-tools-core)")


def run_checker(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), *map(str, args)], capture_output=True, text=True, timeout=60)


def checks(res) -> dict[str, str]:
    """{check name: 'PASS'|'FAIL'} from the checker's output."""
    return {m.group(2): m.group(1) for m in re.finditer(r"^(PASS|FAIL) ([\w.]+):", res.stdout, re.M)}


def check_dir(boot: Path, kconfig: Path, sig: str = SIG):
    return run_checker("--boot-dir", boot, "--kernel-config", kconfig, "--disk-signature", sig)


ALL = {"config.txt", "cmdline.txt", "kernel", "kconfig", "initramfs", "dtb", "devicetree", "overlays"}


@pytest.mark.parametrize("kind", ["debian", "rpi"])
def test_good_boot_partition_passes_every_check(tmp_path, kind):
    kc = fakes.boot_files(tmp_path / "boot", kind, overlays=("wm8960-soundcard",) if kind == "rpi" else ())
    res = check_dir(tmp_path / "boot", kc)
    assert res.returncode == 0, res.stdout + res.stderr
    assert checks(res) == dict.fromkeys(ALL, "PASS")
    assert "all 8 checks passed" in res.stdout
    pages = "4K" if kind == "debian" else "16K"
    assert f"ARM64 Image, {pages} pages" in res.stdout


def _replace_line(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def _drop_kconfig(opt):
    def f(boot, kc):
        kc.write_text("\n".join(line for line in kc.read_text().splitlines() if f"CONFIG_{opt}=" not in line))
    return f


def _initramfs_without(module):
    def f(boot, kc):
        mods = [m for m in fakes.DEBIAN_MODULES if f"/{module}.ko" not in m]
        assert len(mods) == len(fakes.DEBIAN_MODULES) - 1
        (boot / "initramfs_2712").write_bytes(fakes.initramfs(fakes.DEBIAN_KVER, mods))
    return f


# (id, kind, how to break the partition, the check that must fail, words its line must hold)
BROKEN = [
    ("no-config.txt", "debian", lambda b, kc: (b / "config.txt").unlink(), "config.txt", "missing"),
    ("no-cmdline.txt", "debian", lambda b, kc: (b / "cmdline.txt").unlink(), "cmdline.txt", "missing"),
    ("partuuid-not-this-disk", "debian",
     lambda b, kc: _replace_line(b / "cmdline.txt", f"PARTUUID={SIG}-02", "PARTUUID=deadbeef-02"),
     "cmdline.txt", "disk signature is a1b2c3d4"),
    ("cmdline-no-rootwait", "debian", lambda b, kc: _replace_line(b / "cmdline.txt", " rootwait", ""),
     "cmdline.txt", "rootwait"),
    ("cmdline-two-lines", "debian", lambda b, kc: _replace_line(b / "cmdline.txt", " rootfstype", "\nrootfstype"),
     "cmdline.txt", "more than one line"),
    ("kernel-named-by-config-missing", "debian",
     lambda b, kc: _replace_line(b / "config.txt", "arm_64bit=1",
                                 "arm_64bit=1\nkernel=vmlinuz-7.3\ninitramfs initramfs_2712 followkernel"),
     "kernel", "vmlinuz-7.3 (named by config.txt) is not on the boot partition"),
    ("kernel-not-arm64", "debian", lambda b, kc: (b / "kernel_2712.img").write_bytes(b"\x7fELF" + b"\0" * 4096),
     "kernel", "no ARM64 Image magic"),
    ("kernel-efi-zboot", "debian",
     lambda b, kc: (b / "kernel_2712.img").write_bytes(b"MZ\0\0zimg" + b"\0" * 4096), "kernel", "zboot"),
    ("kconfig-no-sd-controller", "debian", _drop_kconfig("MMC_SDHCI_BRCMSTB"), "kconfig", "CONFIG_MMC_SDHCI_BRCMSTB"),
    ("kconfig-no-rp1", "debian", _drop_kconfig("MISC_RP1"), "kconfig", "CONFIG_MFD_RP1/CONFIG_MISC_RP1"),
    ("initramfs-without-sd-driver", "debian", _initramfs_without("sdhci-brcmstb"), "initramfs", "lacks sdhci-brcmstb"),
    ("initramfs-without-rp1-pins", "debian", _initramfs_without("pinctrl-rp1"), "initramfs", "lacks pinctrl-rp1"),
    ("initramfs-missing", "debian", lambda b, kc: (b / "initramfs_2712").unlink(), "initramfs", "not on the boot partition"),
    ("initramfs-garbage", "debian", lambda b, kc: (b / "initramfs_2712").write_bytes(b"garbage" * 100),
     "initramfs", "lsinitramfs cannot read it"),
    ("no-c-stepping-dtb", "debian", lambda b, kc: (b / "bcm2712-rpi-5-b.dtb").unlink(), "dtb", "bcm2712-rpi-5-b.dtb"),
    ("no-d0-dtb-mainline", "debian", lambda b, kc: (b / "bcm2712-d-rpi-5-b.dtb").unlink(), "dtb", "D0-stepping"),
    ("no-d0-overlay-rpi", "rpi", lambda b, kc: (b / "overlays/bcm2712d0.dtbo").unlink(), "dtb", "overlays/bcm2712d0.dtbo"),
    ("no-overlay-map-rpi", "rpi", lambda b, kc: (b / "overlays/overlay_map.dtb").unlink(), "dtb", "overlays/overlay_map.dtb"),
    ("dt-no-sd-host", "debian", lambda b, kc: fakes.dtb(b / "bcm2712-rpi-5-b.dtb", sdhci="brcm,bcm2711-emmc2"),
     "devicetree", "no enabled SD host"),
    ("dt-sd-host-disabled", "debian", lambda b, kc: fakes.dtb(b / "bcm2712-d-rpi-5-b.dtb", sdhci_status="disabled"),
     "devicetree", "bcm2712-d-rpi-5-b.dtb: no enabled SD host"),
    ("dt-no-pcie", "rpi", lambda b, kc: fakes.dtb(b / "bcm2712-rpi-5-b.dtb", pcie="brcm,bcm2711-pcie"),
     "devicetree", "PCIe"),
    ("dt-no-rp1", "debian", lambda b, kc: fakes.dtb(b / "bcm2712-rpi-5-b.dtb", rp1="vendor,other-gpio"),
     "devicetree", "RP1"),
    ("dt-not-a-dtb", "debian", lambda b, kc: (b / "bcm2712-rpi-5-b.dtb").write_bytes(b"not a device tree"),
     "devicetree", "not a device tree"),
    ("dtoverlay-without-dtbo", "rpi",
     lambda b, kc: _replace_line(b / "config.txt", "auto_initramfs=1", "auto_initramfs=1\ndtoverlay=wm8960-soundcard"),
     "overlays", "overlays/wm8960-soundcard.dtbo"),
]


@pytest.mark.parametrize("kind,breaker,check,words", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_each_check_fails_on_its_broken_input(tmp_path, kind, breaker, check, words):
    boot = tmp_path / "boot"
    kc = fakes.boot_files(boot, kind)
    breaker(boot, kc)
    res = check_dir(boot, kc)
    assert res.returncode == 1, res.stdout + res.stderr
    got = checks(res)
    assert got[check] == "FAIL", res.stdout
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith(f"FAIL {check}:"))
    assert words in line, line
    assert "do not flash this image" in res.stdout
    assert "Traceback" not in res.stderr
    # Only what was broken fails (a missing config.txt also loses the initramfs
    # and D0 choices it makes).
    expected = {check} | ({"initramfs", "dtb"} if check == "config.txt" else set())
    assert {k for k, v in got.items() if v == "FAIL"} == expected, res.stdout


@pytest.mark.parametrize("args,words", [
    (["/nonexistent/appliance.img"], "file not found"),
    (["--boot-dir", "/nonexistent"], "not a directory"),
    (["--boot-dir", "/tmp", "--disk-signature", "xyz"], "8 hex digits"),
    ([], "give an image"),
])
def test_bad_input_is_one_line_exit_2(args, words):
    res = run_checker(*args)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and words in res.stderr, res.stderr
    assert res.stdout == ""


def test_not_a_disk_image(tmp_path):
    f = tmp_path / "x.img"
    f.write_bytes(b"\0" * 4096)
    res = run_checker(f)
    assert res.returncode == 2 and "no MBR partition table" in res.stderr
