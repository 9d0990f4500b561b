package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"
)

const cdiKind = "gpushare.io/claim"

type driver struct {
	socket string
	cdiDir string
	mu     sync.Mutex // gpus: replaced when the node's GPUs change
	gpus   []gpu
}

func (d *driver) setGPUs(gpus []gpu) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.gpus = gpus
}

// cdiSpec is the part of the CDI spec format (v0.6.0) the driver writes.
type cdiSpec struct {
	Version string      `json:"cdiVersion"`
	Kind    string      `json:"kind"`
	Devices []cdiDevice `json:"devices"`
}

type cdiDevice struct {
	Name  string   `json:"name"`
	Edits cdiEdits `json:"containerEdits"`
}

type cdiEdits struct {
	Env    []string   `json:"env,omitempty"`
	Mounts []cdiMount `json:"mounts,omitempty"`
}

type cdiMount struct {
	HostPath      string   `json:"hostPath"`
	ContainerPath string   `json:"containerPath"`
	Options       []string `json:"options,omitempty"`
}

func (d *driver) specPath(uid types.UID) string {
	return filepath.Join(d.cdiDir, "gpushare.io-claim_"+string(uid)+".json")
}

// prepare builds one claim's CDI spec: a CDI device per allocated result, whose
// env attaches the container to the node with the claim's memory request and
// its opaque parameters. Writing it again gives the same file (idempotent).
func (d *driver) prepare(claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	alloc := claim.Status.Allocation.Devices
	spec := cdiSpec{Version: "0.6.0", Kind: cdiKind}
	var devices []kubeletplugin.Device
	for i, r := range alloc.Results {
		if r.Driver != driverName {
			continue
		}
		g, ok := d.gpu(r.Device)
		if !ok {
			return nil, fmt.Errorf("claim %s/%s: device %s is not one of this node's GPUs", claim.Namespace, claim.Name, r.Device)
		}
		env := []string{"GPUSHARE_SOCKET=" + d.socket, "NVIDIA_VISIBLE_DEVICES=" + g.UUID}
		var request int64
		if m, ok := r.ConsumedCapacity["memory"]; ok {
			request = m.Value()
			env = append(env, fmt.Sprintf("GPUSHARE_MEMORY=%d", request))
		}
		p, err := parametersFor(alloc.Config, r.Request)
		if err != nil {
			return nil, fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
		}
		if lim := p.limitBytes(); lim > 0 && lim < request {
			return nil, fmt.Errorf("claim %s/%s: GPUShareClaimParameters.memoryLimit %s is below the request's memory %d bytes: give a limit at least the request", claim.Namespace, claim.Name, p.MemoryLimit, request)
		}
		env = append(env, p.env()...)
		name := fmt.Sprintf("%s-%d", claim.UID, i)
		spec.Devices = append(spec.Devices, cdiDevice{Name: name, Edits: cdiEdits{
			Env:    env,
			Mounts: []cdiMount{{HostPath: d.socket, ContainerPath: d.socket, Options: []string{"rbind"}}},
		}})
		devices = append(devices, kubeletplugin.Device{
			Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
			CDIDeviceIDs: []string{cdiKind + "=" + name},
		})
	}
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(d.cdiDir, 0o755); err != nil {
		return nil, err
	}
	tmp := d.specPath(claim.UID) + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return nil, err
	}
	return devices, os.Rename(tmp, d.specPath(claim.UID))
}

// parametersFor merges the opaque configurations of this driver that apply to
// one request (those naming no request apply to all), in order: the class's
// first, then the claim's, a later field overriding an earlier one.
func parametersFor(configs []resourceapi.DeviceAllocationConfiguration, request string) (ClaimParameters, error) {
	var merged ClaimParameters
	for _, c := range configs {
		if c.Opaque == nil || c.Opaque.Driver != driverName {
			continue
		}
		if len(c.Requests) > 0 && !slices.Contains(c.Requests, request) {
			continue
		}
		p, err := parseParameters(c.Opaque.Parameters.Raw)
		if err != nil {
			return merged, err
		}
		merged = merged.with(p)
	}
	return merged, nil
}

func (d *driver) gpu(device string) (gpu, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, g := range d.gpus {
		if deviceName(g) == device {
			return g, true
		}
	}
	return gpu{}, false
}

func (d *driver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		devs, err := d.prepare(c)
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	return out, nil
}

func (d *driver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		err := os.Remove(d.specPath(c.UID))
		if os.IsNotExist(err) {
			err = nil // unprepared already: the kubelet may ask again
		}
		out[c.UID] = err
	}
	return out, nil
}

func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, strings.TrimSpace(msg))
}

// WatchHealthStatus: the node reports a GPU's trouble through its own metrics and
// status; device health through DRA is not built yet.
func (d *driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
