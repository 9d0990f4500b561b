// gpushare-dra: gpushare's DRA kubelet plugin. It publishes one ResourceSlice
// pool for its node (each GPU a shareable device whose consumable capacity is
// its memory); prepares claims by telling the node each one's share (which bounds
// the sessions that name it) and writing a CDI spec that hands the container the
// node's socket and its GPUSHARE_* settings; and shows each claim's live share on
// its status.devices.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"reflect"
	"strings"
	"syscall"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
)

const (
	driverName = "gpu.gpushare.io"
	version    = "0.1.0" // this driver's, a semver as DRA version attributes are
)

func deviceName(g gpu) string { return fmt.Sprintf("gpu-%d", g.Index) }

// resources is the node's pool: one slice, each GPU a device that many
// claims may share, each taking a part of its memory.
func resources(nodeName string, st status) resourceslice.DriverResources {
	shared := true
	devices := make([]resourceapi.Device, 0, len(st.GPUs))
	for _, g := range st.GPUs {
		sim := g.Simulated
		model, uuid, ver, gsVer := g.Name, g.UUID, version, st.Version
		devices = append(devices, resourceapi.Device{
			Name:                     deviceName(g),
			AllowMultipleAllocations: &shared,
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"model":           {StringValue: &model},
				"uuid":            {StringValue: &uuid},
				"simulated":       {BoolValue: &sim},
				"driverVersion":   {VersionValue: &ver},
				"gpushareVersion": {StringValue: &gsVer},
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				"memory": {Value: *resource.NewQuantity(g.MemoryBytes, resource.BinarySI)},
			},
		})
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		nodeName: {Slices: []resourceslice.Slice{{Devices: devices}}},
	}}
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "kubelet-call" {
		if err := kubeletCall(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "gpushare-dra kubelet-call:", err)
			os.Exit(1)
		}
		return
	}
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig (default: in-cluster)")
	nodeName := flag.String("node-name", os.Getenv("NODE_NAME"), "this node's name")
	ctl := flag.String("gpushare", "gpushare", "the gpushare command (words split on spaces) that reads the node's status")
	admin := flag.String("admin-socket", "/run/gpushare-admin/admin.sock", "the node's admin socket (the base DaemonSet's)")
	socket := flag.String("socket", "/run/gpushare/workload.sock", "the node's workload socket, given to containers")
	pluginDir := flag.String("plugin-dir", "/var/lib/kubelet/plugins/"+driverName, "the plugin's socket folder")
	registrarDir := flag.String("registrar-dir", "/var/lib/kubelet/plugins_registry", "the kubelet's registration folder")
	cdiDir := flag.String("cdi-dir", "/var/run/cdi", "where CDI specs are written")
	publishOnly := flag.Bool("publish-only", false, "publish the slices and serve no kubelet gRPC")
	resync := flag.Duration("resync", 30*time.Second, "how often the node's GPUs are read again (a change is published)")
	klog.InitFlags(nil)
	flag.Parse()
	if *nodeName == "" {
		fmt.Fprintln(os.Stderr, "gpushare-dra: no node name: pass --node-name or set NODE_NAME from spec.nodeName")
		os.Exit(2)
	}
	if *resync <= 0 {
		fmt.Fprintln(os.Stderr, "gpushare-dra: --resync must be above 0: give a duration such as 30s")
		os.Exit(2)
	}
	if err := run(*kubeconfig, *nodeName, strings.Fields(*ctl), *admin, *socket, *pluginDir, *registrarDir, *cdiDir, *publishOnly, *resync); err != nil {
		fmt.Fprintln(os.Stderr, "gpushare-dra:", err)
		os.Exit(1)
	}
}

func run(kubeconfig, nodeName string, ctl []string, admin, socket, pluginDir, registrarDir, cdiDir string, publishOnly bool, resync time.Duration) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	n := nodeCtl{ctl: ctl, admin: admin}
	st, err := n.status()
	if err != nil {
		return err
	}
	d := &driver{socket: socket, cdiDir: cdiDir, node: n, statuses: newClaimStatus(client), gpus: st.GPUs}
	if err := d.loadPrepared(); err != nil {
		return err
	}
	d.resend() // the node may have started again while the plugin was down
	if err := os.MkdirAll(pluginDir, 0o750); err != nil {
		return err
	}
	opts := []kubeletplugin.Option{
		kubeletplugin.DriverName(driverName),
		kubeletplugin.NodeName(nodeName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.PluginDataDirectoryPath(pluginDir),
		kubeletplugin.RegistrarDirectoryPath(registrarDir),
	}
	if publishOnly {
		opts = append(opts, kubeletplugin.RegistrationService(false), kubeletplugin.DRAService(false))
	}
	helper, err := kubeletplugin.Start(ctx, d, opts...)
	if err != nil {
		return err
	}
	defer helper.Stop()
	published := resources(nodeName, st)
	if err := helper.PublishResources(ctx, published); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "gpushare-dra: published %d GPU(s) for node %s\n", len(st.GPUs), nodeName)
	d.refresh(ctx, st)
	// The node is read again every resync: a change of its GPUs (the node restarted on
	// other GPUs) is published; a node started again is told the prepared claims again;
	// each claim's share on its status follows the node's figures. Where the node does
	// not answer, the last pool stays.
	tick := time.NewTicker(resync)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		now, err := n.status()
		if err != nil {
			klog.ErrorS(err, "reading the node's GPUs again; the published pool stays")
			continue
		}
		if now.Node.Started != st.Node.Started {
			d.resend()
			fmt.Fprintf(os.Stderr, "gpushare-dra: the node started again: told it %d prepared claim(s)\n", len(d.claims()))
		}
		st = now
		d.setGPUs(st.GPUs)
		if r := resources(nodeName, st); !reflect.DeepEqual(r, published) {
			if err := helper.PublishResources(ctx, r); err != nil {
				return err
			}
			published = r
			fmt.Fprintf(os.Stderr, "gpushare-dra: the node's GPUs changed: published %d GPU(s)\n", len(st.GPUs))
		}
		d.refresh(ctx, st)
	}
}
