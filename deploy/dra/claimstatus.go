package main

// A prepared claim's live share, written to its status.devices entry (this driver's
// entry alone) at prepare and whenever the node's figures for it change, read each
// resync.

import (
	"context"
	"encoding/json"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
)

// share is a status.devices entry's data: the claim's figures and its sessions' now.
type share struct {
	MemoryRequestBytes int64   `json:"memoryRequestBytes"`
	MemoryLimitBytes   int64   `json:"memoryLimitBytes"` // 0: none given, the request
	Weight             float64 `json:"weight,omitempty"`
	Sessions           int     `json:"sessions"` // attached now
	State              string  `json:"state"`    // the busiest: holding, yielding, waiting, idle; "" with none
	ResidentBytes      int64   `json:"residentBytes"`
	SwappedBytes       int64   `json:"swappedBytes"`
	Simulated          bool    `json:"simulated"`
}

var busier = map[string]int{"idle": 1, "waiting": 2, "yielding": 3, "holding": 4}

// shareOf is p's share from the node's status: its sessions are those shown by its UID.
func shareOf(p prepared, st status) share {
	s := share{MemoryRequestBytes: p.MemoryRequest, MemoryLimitBytes: p.MemoryLimit, Weight: p.Weight}
	for _, g := range st.GPUs {
		if g.Index != p.GPU {
			continue
		}
		s.Simulated = g.Simulated
		for _, x := range g.Sessions {
			if x.Claim != string(p.UID) {
				continue
			}
			s.Sessions++
			s.ResidentBytes += x.ResidentBytes
			s.SwappedBytes += x.SwappedBytes
			if busier[x.State] > busier[s.State] {
				s.State = x.State
			}
		}
	}
	return s
}

type claimStatus struct {
	client kubernetes.Interface // nil: no status written (the unit tests)
	mu     sync.Mutex
	last   map[types.UID]share // what each claim's status says now
}

func newClaimStatus(client kubernetes.Interface) *claimStatus {
	return &claimStatus{client: client, last: map[types.UID]share{}}
}

// write sets p's status.devices entry to s, where it says something else.
func (c *claimStatus) write(ctx context.Context, p prepared, s share) error {
	if c.client == nil {
		return nil
	}
	c.mu.Lock()
	before, ok := c.last[p.UID]
	c.mu.Unlock()
	if ok && before == s {
		return nil
	}
	data, err := json.Marshal(s)
	if err != nil {
		return err
	}
	dev := resourceapi.AllocatedDeviceStatus{Driver: driverName, Pool: p.Pool, Device: p.Device, Data: &runtime.RawExtension{Raw: data}}
	if p.ShareID != "" {
		dev.ShareID = ptr.To(p.ShareID)
	}
	if err := c.update(ctx, p, &dev); err != nil {
		return err
	}
	c.mu.Lock()
	c.last[p.UID] = s
	c.mu.Unlock()
	return nil
}

// clear takes this driver's entry off p's status (the claim gone is no error).
func (c *claimStatus) clear(ctx context.Context, p prepared) error {
	c.mu.Lock()
	delete(c.last, p.UID)
	c.mu.Unlock()
	if c.client == nil {
		return nil
	}
	return c.update(ctx, p, nil)
}

// update replaces p's entry in the claim's status.devices by dev (nil: none), leaving
// other drivers' entries as they are. A read and an update on the status subresource,
// again on a conflict: a server-side apply of status.devices alone would also send the
// allocation the scheduler owns as unset, which the server refuses.
func (c *claimStatus) update(ctx context.Context, p prepared, dev *resourceapi.AllocatedDeviceStatus) error {
	claims := c.client.ResourceV1().ResourceClaims(p.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		claim, err := claims.Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if claim.UID != p.UID {
			return nil // another claim by that name now: ours is gone
		}
		devices := make([]resourceapi.AllocatedDeviceStatus, 0, len(claim.Status.Devices)+1)
		for _, d := range claim.Status.Devices {
			if d.Driver != driverName || d.Pool != p.Pool || d.Device != p.Device || ptr.Deref(d.ShareID, "") != p.ShareID {
				devices = append(devices, d)
			}
		}
		if dev != nil {
			devices = append(devices, *dev)
		}
		if len(devices) == 0 {
			devices = nil
		}
		claim.Status.Devices = devices
		_, err = claims.UpdateStatus(ctx, claim, metav1.UpdateOptions{FieldManager: driverName})
		return err
	})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}
