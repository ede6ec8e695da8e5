"""Fake Raspberry Pi 5 kernel inputs, made at test time (nothing binary is committed).

A Pi 5 kernel package cannot be installed in the fast tests (the Raspberry Pi
archive is unreachable here, and a real Debian kernel root takes half an hour
under emulation), so these stand in for its files, built with the same tools
the real ones are read with:

* an ARM64 ``Image``: the 64-byte arm64 boot header (magic ``ARM\\x64`` at
  byte 56, page size in the flags) and a ``Linux version`` banner;
* device trees compiled with ``dtc`` from a small source that has (or, for
  the failing cases, lacks) the BCM2712 SD host, PCIe and RP1 nodes;
* an initramfs: a ``newc`` cpio archive (what ``lsinitramfs`` reads) holding
  empty module files at their real paths;
* the kernel's config, with the options Debian's 7.3 arm64 kernel sets.

``boot_files`` lays out a boot partition the way each kernel kind does;
``root_files`` lays out the kernel package's files in a root file system for
build-image.sh --rootfs-tar.
"""

from __future__ import annotations

import gzip
import struct
import subprocess
from pathlib import Path

DEBIAN_KVER = "7.3.4+deb13-arm64"
RPI_KVER = "6.12.47+rpt-rpi-2712"

DTS = """/dts-v1/;
/ {{
    compatible = "raspberrypi,5-model-b", "brcm,bcm2712";
    #address-cells = <2>;
    #size-cells = <1>;
    soc@107c000000 {{
        compatible = "simple-bus";
        #address-cells = <1>;
        #size-cells = <1>;
        mmc@fff000 {{
            compatible = "{sdhci}", "brcm,sdhci-brcmstb";
            reg = <0xfff000 0x260>;
            status = "{sdhci_status}";
        }};
    }};
    pcie@1000120000 {{
        compatible = "{pcie}";
        rp1 {{
            gpio@d0000 {{ compatible = "{rp1}"; }};
        }};
    }};
}};
"""

OVERLAY_DTS = """/dts-v1/;
/plugin/;
/ { fragment@0 { target-path = "/"; __overlay__ { }; }; };
"""

# Debian 7.3.4's values (checked from linux-base-7.3.4+deb13-arm64) for the
# options tools/check-pi5-boot looks at.
DEBIAN_KCONFIG = {
    "MMC_SDHCI_BRCMSTB": "m", "MMC_SDHCI": "m", "MMC_SDHCI_PLTFM": "m", "MMC_BLOCK": "y",
    "REGULATOR_GPIO": "m", "GPIO_BRCMSTB": "m", "PINCTRL_BCM2712": "m", "EXT4_FS": "m",
    "PCIE_BRCMSTB": "y", "MISC_RP1": "m", "PINCTRL_RP1": "m", "COMMON_CLK_RP1": "m",
    "BCM2712_MIP": "m", "USB_DWC3": "m", "SND_USB_AUDIO": "m", "GPIO_CDEV": "y", "OF_OVERLAY": "y",
    "ARM64_4K_PAGES": "y",
}
# The Raspberry Pi kernel builds the SoC and RP1 drivers in.
RPI_KCONFIG = {k: ("y" if v == "m" and k not in ("USB_DWC3", "SND_USB_AUDIO") else v)
               for k, v in DEBIAN_KCONFIG.items() if k != "MISC_RP1"}
RPI_KCONFIG.update({"MFD_RP1": "y", "ARM64_4K_PAGES": "n", "ARM64_16K_PAGES": "y"})

# Module files of the boot-critical =m options above (paths as in the package).
DEBIAN_MODULES = [
    "kernel/drivers/mmc/host/sdhci-brcmstb.ko.xz", "kernel/drivers/mmc/host/sdhci.ko.xz",
    "kernel/drivers/mmc/host/sdhci-pltfm.ko.xz", "kernel/drivers/regulator/gpio-regulator.ko.xz",
    "kernel/drivers/gpio/gpio-brcmstb.ko.xz", "kernel/drivers/pinctrl/bcm/pinctrl-brcmstb-bcm2712.ko.xz",
    "kernel/fs/ext4/ext4.ko.xz", "kernel/drivers/misc/rp1/rp1_pci.ko.xz",
    "kernel/drivers/pinctrl/pinctrl-rp1.ko.xz", "kernel/drivers/clk/clk-rp1.ko.xz",
    "kernel/drivers/irqchip/irq-bcm2712-mip.ko.xz",
]


def arm64_image(kver: str, pages: int = 4) -> bytes:
    """A minimal arm64 boot Image: header + version banner + padding."""
    page_bits = {4: 1, 16: 2, 64: 3}[pages]
    header = struct.pack("<IIQQQQQQIi", 0x91005A4D, 0x14000000, 0, 0x100000, page_bits << 1, 0, 0, 0,
                         0x644D5241, 0)
    assert len(header) == 64 and header[56:60] == b"ARM\x64"
    banner = f"Linux version {kver} (fake@test) (gcc) #1 SMP\n".encode()
    return header + b"\0" * 192 + banner + b"\0" * 256


def kconfig_text(values: dict[str, str]) -> str:
    lines = ["# fake kernel config"]
    for k, v in values.items():
        lines.append(f"CONFIG_{k}={v}" if v in ("y", "m") else f"# CONFIG_{k} is not set")
    return "\n".join(lines) + "\n"


def cpio_newc(entries: dict[str, bytes]) -> bytes:
    """An uncompressed newc cpio archive (directories implied are added)."""
    out, ino = bytearray(), 1
    names: dict[str, bytes | None] = {}
    for path in sorted(entries):
        parts = path.split("/")
        for i in range(1, len(parts)):
            names.setdefault("/".join(parts[:i]), None)
        names[path] = entries[path]
    for name in sorted(names) + ["TRAILER!!!"]:
        data = names.get(name) or b""
        mode = 0o040755 if name in names and names[name] is None else 0o100644
        if name == "TRAILER!!!":
            mode = 0
        fname = name.encode() + b"\0"
        hdr = "070701" + "".join("%08X" % v for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(fname), 0))
        out += hdr.encode() + fname
        out += b"\0" * ((4 - len(out) % 4) % 4)
        out += data
        out += b"\0" * ((4 - len(out) % 4) % 4)
        ino += 1
    out += b"\0" * ((512 - len(out) % 512) % 512)  # cpio's 512-byte blocks
    return bytes(out)


def initramfs(kver: str, modules: list[str]) -> bytes:
    files = {f"usr/lib/modules/{kver}/{m}": b"" for m in modules}
    files["init"] = b"#!/bin/sh\n"
    # Compressed, like a real one (lsinitramfs reads an uncompressed archive
    # only as the early-microcode part in front of a compressed one).
    return gzip.compress(cpio_newc(files), mtime=0)


def dtb(dest: Path, sdhci="brcm,bcm2712-sdhci", sdhci_status="okay", pcie="brcm,bcm2712-pcie",
        rp1="raspberrypi,rp1-gpio") -> None:
    src = DTS.format(sdhci=sdhci, sdhci_status=sdhci_status, pcie=pcie, rp1=rp1)
    subprocess.run(["dtc", "-q", "-I", "dts", "-O", "dtb", "-o", str(dest), "-"], input=src.encode(), check=True)


def dtbo(dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dtc", "-q", "-@", "-I", "dts", "-O", "dtb", "-o", str(dest), "-"],
                   input=OVERLAY_DTS.encode(), check=True)


def boot_files(boot: Path, kind: str, sig: str = "a1b2c3d4", overlays: tuple[str, ...] = ()) -> Path:
    """A passing Pi 5 boot partition for kind 'debian' or 'rpi'. Returns the
    kernel config file written next to it (for --kernel-config)."""
    boot.mkdir(parents=True, exist_ok=True)
    debian = kind == "debian"
    kver = DEBIAN_KVER if debian else RPI_KVER
    config = ["[all]", "arm_64bit=1", "auto_initramfs=1"]
    if debian:
        config.append("upstream_kernel=1")
    config += [f"dtoverlay={o}" for o in overlays]
    (boot / "config.txt").write_text("\n".join(config) + "\n")
    console = "ttyAMA10" if debian else "serial0"
    (boot / "cmdline.txt").write_text(f"console={console},115200 root=PARTUUID={sig}-02 rootfstype=ext4 rootwait\n")
    (boot / "kernel_2712.img").write_bytes(arm64_image(kver, 4 if debian else 16))
    (boot / "initramfs_2712").write_bytes(initramfs(kver, DEBIAN_MODULES if debian else []))
    dtb(boot / "bcm2712-rpi-5-b.dtb")
    if debian:
        dtb(boot / "bcm2712-d-rpi-5-b.dtb")
    else:
        dtb(boot / "bcm2712d0-rpi-5-b.dtb")
        dtbo(boot / "overlays" / "bcm2712d0.dtbo")
        dtb(boot / "overlays" / "overlay_map.dtb")
    for o in overlays:
        dtbo(boot / "overlays" / f"{o}.dtbo")
    kc = boot.parent / f"{boot.name}.config"
    kc.write_text(kconfig_text(DEBIAN_KCONFIG if debian else RPI_KCONFIG))
    return kc


def root_files(root: Path, kind: str, hat_overlays: tuple[str, ...] = ()) -> None:
    """The files a kernel package puts in the root, laid out like the real
    one: Debian 7.x (/usr/lib/modules/VER/{vmlinuz,config,dtb}) or the
    Raspberry Pi kernel (/boot/vmlinuz-VER, /usr/lib/linux-image-VER/)."""
    if kind == "debian":
        kver = DEBIAN_KVER
        mod = root / "usr/lib/modules" / kver
        (mod / "dtb/broadcom").mkdir(parents=True, exist_ok=True)
        (mod / "vmlinuz").write_bytes(arm64_image(kver, 4))
        (mod / "config").write_text(kconfig_text(DEBIAN_KCONFIG))
        dtb(mod / "dtb/broadcom/bcm2712-rpi-5-b.dtb")
        dtb(mod / "dtb/broadcom/bcm2712-d-rpi-5-b.dtb")
        link = root / "usr/lib" / f"linux-image-{kver}"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(f"modules/{kver}/dtb")
        (root / "boot").mkdir(exist_ok=True)
        (root / "boot" / f"initrd.img-{kver}").write_bytes(initramfs(kver, DEBIAN_MODULES))
    else:
        kver = RPI_KVER
        (root / "usr/lib/modules" / kver).mkdir(parents=True, exist_ok=True)
        (root / "boot").mkdir(exist_ok=True)
        (root / "boot" / f"vmlinuz-{kver}").write_bytes(arm64_image(kver, 16))
        (root / "boot" / f"config-{kver}").write_text(kconfig_text(RPI_KCONFIG))
        (root / "boot" / f"initrd.img-{kver}").write_bytes(initramfs(kver, []))
        kdir = root / "usr/lib" / f"linux-image-{kver}"
        (kdir / "broadcom").mkdir(parents=True, exist_ok=True)
        dtb(kdir / "broadcom/bcm2712-rpi-5-b.dtb")
        dtb(kdir / "broadcom/bcm2712d0-rpi-5-b.dtb")
        dtbo(kdir / "overlays/bcm2712d0.dtbo")
        dtb(kdir / "overlays/overlay_map.dtb")
        for o in hat_overlays:
            dtbo(kdir / "overlays" / f"{o}.dtbo")
