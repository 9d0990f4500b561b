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
	socket   string
	cdiDir   string
	node     node
	statuses *claimStatus
	mu       sync.Mutex // gpus: replaced when the node's GPUs change; prepared
	gpus     []gpu
	prepared map[types.UID]prepared // the claims prepared here, as their specs say
}

// annotation holds a spec's claim as the node was told it (prepared, JSON).
const annotation = "gpushare.io/prepared"

func (d *driver) setGPUs(gpus []gpu) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.gpus = gpus
}

// cdiSpec is the part of the CDI spec format (v0.6.0) the driver writes.
type cdiSpec struct {
	Version     string            `json:"cdiVersion"`
	Kind        string            `json:"kind"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Devices     []cdiDevice       `json:"devices"`
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

// prepare tells the node the claim's share (it binds the claim's sessions to it),
// then writes its CDI spec: one CDI device whose env attaches the container to the
// node with the claim's memory request and opaque parameters. Done again, it gives the
// same file and tells the node the same (idempotent).
func (d *driver) prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	alloc := claim.Status.Allocation.Devices
	var mine []resourceapi.DeviceRequestAllocationResult
	for _, r := range alloc.Results {
		if r.Driver == driverName {
			mine = append(mine, r)
		}
	}
	if len(mine) != 1 {
		return nil, fmt.Errorf("claim %s/%s: %d gpushare devices allocated: a claim is one share of one GPU; ask for each share in a claim of its own", claim.Namespace, claim.Name, len(mine))
	}
	r := mine[0]
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
	env = append(env, "GPUSHARE_CLAIM="+string(claim.UID))
	told := prepared{
		UID: claim.UID, Namespace: claim.Namespace, Name: claim.Name, GPU: g.Index,
		Pods: podsOf(claim), MemoryRequest: request, MemoryLimit: p.limitBytes(),
		Pool: r.Pool, Device: r.Device,
	}
	if p.Weight != nil {
		told.Weight = *p.Weight
	}
	if p.ComputeLimit != nil {
		told.ComputeLimit = *p.ComputeLimit
	}
	if r.ShareID != nil {
		told.ShareID = string(*r.ShareID)
	}
	if err := d.node.prepare(told); err != nil {
		return nil, fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	name := string(claim.UID) + "-0"
	note, err := json.Marshal(told)
	if err != nil {
		return nil, err
	}
	spec := cdiSpec{Version: "0.6.0", Kind: cdiKind, Annotations: map[string]string{annotation: string(note)}}
	spec.Devices = []cdiDevice{{Name: name, Edits: cdiEdits{
		Env:    env,
		Mounts: []cdiMount{{HostPath: d.socket, ContainerPath: d.socket, Options: []string{"rbind"}}},
	}}}
	if err := d.writeSpec(claim.UID, spec); err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.prepared[claim.UID] = told
	d.mu.Unlock()
	if err := d.statuses.write(ctx, told, shareOf(told, status{GPUs: []gpu{g}})); err != nil {
		klog.FromContext(ctx).Error(err, "writing the claim's status.devices", "claim", claim.Namespace+"/"+claim.Name)
	}
	return []kubeletplugin.Device{{
		Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
		CDIDeviceIDs: []string{cdiKind + "=" + name},
	}}, nil
}

// podsOf is the UIDs of the pods the claim is reserved for.
func podsOf(claim *resourceapi.ResourceClaim) []string {
	var out []string
	for _, c := range claim.Status.ReservedFor {
		if c.APIGroup == "" && c.Resource == "pods" {
			out = append(out, string(c.UID))
		}
	}
	slices.Sort(out)
	return out
}

func (d *driver) writeSpec(uid types.UID, spec cdiSpec) error {
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(d.cdiDir, 0o755); err != nil {
		return err
	}
	tmp := d.specPath(uid) + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, d.specPath(uid))
}

// loadPrepared reads back the claims this node's specs hold (the plugin started
// again: its claims are still prepared).
func (d *driver) loadPrepared() error {
	files, err := filepath.Glob(filepath.Join(d.cdiDir, "gpushare.io-claim_*.json"))
	if err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.prepared == nil {
		d.prepared = map[types.UID]prepared{}
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		var spec cdiSpec
		var p prepared
		if err := json.Unmarshal(data, &spec); err != nil || json.Unmarshal([]byte(spec.Annotations[annotation]), &p) != nil || p.UID == "" {
			klog.ErrorS(err, "a CDI spec of this driver without its claim: left as it is", "file", f)
			continue
		}
		d.prepared[p.UID] = p
	}
	return nil
}

// claims is the prepared claims, by UID order.
func (d *driver) claims() []prepared {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]prepared, 0, len(d.prepared))
	for _, p := range d.prepared {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b prepared) int { return strings.Compare(string(a.UID), string(b.UID)) })
	return out
}

// resend tells a node started again every claim prepared on it.
func (d *driver) resend() {
	for _, p := range d.claims() {
		if err := d.node.prepare(p); err != nil {
			klog.ErrorS(err, "telling the node a prepared claim again", "claim", p.Namespace+"/"+p.Name)
		}
	}
}

// refresh writes each prepared claim's share, from the node's status, where it changed.
func (d *driver) refresh(ctx context.Context, st status) {
	for _, p := range d.claims() {
		if err := d.statuses.write(ctx, p, shareOf(p, st)); err != nil {
			klog.ErrorS(err, "writing the claim's status.devices", "claim", p.Namespace+"/"+p.Name)
		}
	}
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

func (d *driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		devs, err := d.prepare(ctx, c)
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	return out, nil
}

// UnprepareResourceClaims tells the node (it ends the claim's sessions that are left),
// takes the share off the claim's status, and removes the spec; a claim unprepared
// already is no error (the kubelet may ask again).
func (d *driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		out[c.UID] = d.unprepare(ctx, c)
	}
	return out, nil
}

func (d *driver) unprepare(ctx context.Context, c kubeletplugin.NamespacedObject) error {
	if err := d.node.unprepare(c.UID); err != nil {
		return fmt.Errorf("claim %s/%s: %w", c.Namespace, c.Name, err)
	}
	d.mu.Lock()
	p, ok := d.prepared[c.UID]
	delete(d.prepared, c.UID)
	d.mu.Unlock()
	if ok {
		if err := d.statuses.clear(ctx, p); err != nil {
			klog.FromContext(ctx).Error(err, "clearing the claim's status.devices", "claim", c.Namespace+"/"+c.Name)
		}
	}
	err := os.Remove(d.specPath(c.UID))
	if os.IsNotExist(err) {
		return nil
	}
	return err
}

func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, strings.TrimSpace(msg))
}

// WatchHealthStatus: the node reports a GPU's trouble through its own metrics and
// status; device health through DRA is not built yet.
func (d *driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
